"""The evidence and its judgement: each candidate's row and the ranking (`rows`, `rank`, `signals`), the recipes'
verdicts (`agreement`), the answer sized to its evidence (`answer`), the effective speedup (`speedup`), the norm tax
(`tax`), the ladder and its projection (`ladder`, `holdout`), and the gate (`gate`)."""
