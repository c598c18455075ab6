"""Weight conversion between vitlab and other implementations (pure functions over state dicts)."""
