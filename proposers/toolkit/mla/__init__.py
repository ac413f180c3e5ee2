"""Multi-head latent attention (DeepSeek-V3 / Kimi K3), for the MLA drafters."""
