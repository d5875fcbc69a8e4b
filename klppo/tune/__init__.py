"""klppo.tune"""
