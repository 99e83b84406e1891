"""Privacy accounting (filled by the accounting work)."""
