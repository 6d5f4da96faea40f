"""The types a request goes through, below every layer that uses them: its tokens and block keys
(`tokens.py`), its prepared plan (`plan.py`), what it asks and gets back (`score.py`). Nothing
here imports the rest of `tiered`."""
