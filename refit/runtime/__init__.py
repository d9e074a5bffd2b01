"""The worker side of a refit: endpoints, the refit watchdog, and handles that reach workers."""
