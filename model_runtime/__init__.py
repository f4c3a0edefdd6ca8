"""The language-model runtime both sides load models with (one CausalLM interface)."""
