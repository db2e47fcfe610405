"""Test support shared by the suite (fake tiers)."""
