"""The embedded demo: a tiny decoder-only transformer trained on text that ships with Python."""
