"""klppo.batching"""
