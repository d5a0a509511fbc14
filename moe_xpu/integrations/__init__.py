"""Integrations of moe_xpu into model libraries (imported on demand; not needed by the core)."""
