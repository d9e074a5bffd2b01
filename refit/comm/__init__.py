"""Communicators: the stateless process group (own rendezvous, gloo or NCCL) and torch groups."""
