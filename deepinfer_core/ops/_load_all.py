"""Imports every op family module so that their ops are registered."""
