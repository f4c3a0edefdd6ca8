"""personal_index"""
