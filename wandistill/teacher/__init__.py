"""Teacher models: real diffusers Wan 2.1/2.2 folders and tiny offline stand-ins."""
