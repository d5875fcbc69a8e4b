"""klppo.data"""
