"""A pipeline's components: what they are and their roles, and how each call of one is watched."""
