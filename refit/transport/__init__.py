"""Executors that move a rank's plan over a communicator, and the single-tensor entry points."""
