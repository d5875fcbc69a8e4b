"""klppo.config"""
