"""Sizing an engine from a command's side: options turned into BatchEngine's arguments, memory
plans, and the batch size measured on this machine. The engine's core imports none of it."""
