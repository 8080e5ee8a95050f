"""KV tiers below the device pool: host memory (and disk) keyed by the prefix cache's block
hashes. Split by role like the KV connector: ``TierManager`` (manager.py) is the scheduler's
metadata and decides the per-step ``TierOps`` (ops.py); ``HostTierStore`` (host_store.py) is
each rank's host memory and runs them; ``DiskTier`` (disk.py) writes behind the host tier."""
