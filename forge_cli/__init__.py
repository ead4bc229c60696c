"""forge command line and tuning engine."""
