"""Canvas presets (YAML, one file each), read by `h3render.jobs.load_presets`; a data package in the wheel."""
