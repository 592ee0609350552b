"""Teacher models: loading real diffusers Wan 2.1/2.2 folders and building tiny offline stand-ins."""
