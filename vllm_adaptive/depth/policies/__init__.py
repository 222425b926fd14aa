"""Exit signals: when a token may stop. Each policy is one file and holds no KV logic."""
