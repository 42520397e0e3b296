"""EAGLE3 draft head for a GPT-OSS target (config, checkpoint layout, draft graph)."""
