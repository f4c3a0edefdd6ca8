"""What both sides keep on disk, below everything else in collab (it imports nothing else of
collab): crash-safe files and hashes (`files`), where things live (`paths`), the one SQLite
migration engine (`migrations`)."""
