"""Shared by device and cloud: wire protocol and the decoding math. Imports nothing of ours."""
