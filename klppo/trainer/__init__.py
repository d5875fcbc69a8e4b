"""klppo.trainer"""
