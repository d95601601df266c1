"""The winner's settings as code bases write them (`snippets`), each code base's settings as data (`settings`) and the
patches where its settings do not reach (`patches`)."""
