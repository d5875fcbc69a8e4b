"""klppo.rewards"""
