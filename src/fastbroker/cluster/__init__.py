"""Clustering: discovery, transport, membership by consensus and the partition map."""
