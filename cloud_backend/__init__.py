"""cloud_backend"""
