"""klppo.rollout"""
