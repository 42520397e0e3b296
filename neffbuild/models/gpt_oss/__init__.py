"""GPT-OSS: config, checkpoint loading, weight stacking, the GK decode graph and prefill."""
