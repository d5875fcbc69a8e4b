"""klppo.tracking"""
