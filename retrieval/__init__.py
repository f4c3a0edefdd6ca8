"""Chunking, embedding and the FAISS + SQLite store: shared by the private index and the
cloud's public corpus."""
