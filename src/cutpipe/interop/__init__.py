"""Bridges to other pipeline libraries. Each imports its library only when called."""
