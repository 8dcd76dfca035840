"""The five deployable services; each package holds servicer, settings, domain code and __main__."""
