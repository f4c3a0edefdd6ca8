"""The Tandem TUI (Textual). Imported only by `tandem` with no arguments: the rest of the CLI
stays headless."""
