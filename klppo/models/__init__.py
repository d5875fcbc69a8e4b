"""klppo.models"""
