"""klppo.algorithms"""
