"""Shared test helpers: oracles (the slow, obviously-right references) and input makers."""
