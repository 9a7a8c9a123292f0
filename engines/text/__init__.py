"""Text both sides cut: sentence and clause splitting (sentences.py), the one engines module the
service imports besides the contract. Plain Python, no torch."""
