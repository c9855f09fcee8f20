"""Personal data and secrets out of everything Sluice stores or emits: the redaction
engine (redaction.py), its recognizers' checks (patterns.py) and the logging filter
every record passes (logredact.py)."""
