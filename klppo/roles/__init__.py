"""klppo.roles"""
