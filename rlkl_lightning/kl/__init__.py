"""KL measurement and control: estimators, the KL loss, control laws and the two callbacks.

Imports only torch, Lightning and the package's shared modules, so the callbacks plug into any
LightningModule.
"""
