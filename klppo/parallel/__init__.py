"""klppo.parallel"""
