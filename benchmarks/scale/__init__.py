"""Models larger than memory: in-memory and offloaded compression compared."""
