"""The recommendation in words and as a page (`explain`) and the ranking's figure (`ranking_figure`)."""
