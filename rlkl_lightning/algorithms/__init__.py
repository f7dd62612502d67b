"""The Lightning modules (``PPOModule``, ``RLOOModule``) and the phases they share."""
