"""The pause's writes: the engine half of staging (casts, undo log, device copies), the
scatter with its read-back, the failure-atomic restore, the compiled host loop, the device fence.
"""
