"""The Shoal peer: data-plane server, collectives, aggregation, state sync and the training loop.

A volunteer installs and runs only this side; it never imports `coordinator`.
"""
