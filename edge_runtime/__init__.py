"""edge_runtime"""
