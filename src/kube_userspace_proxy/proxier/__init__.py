"""The proxier: reconcile a desired Snapshot against proxy ports, endpoint pools and rules.

- `reconciler`: `Proxier`, the data-plane and rule-sink contracts it drives.
"""
