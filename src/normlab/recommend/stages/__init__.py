"""The stages of a recommendation over one `Context` (`context`): screen, training rounds, ladder, verify, conclusion
and its speedup gate, run in order by `pipeline`; the typed records they keep (`records`)."""
