"""lingvo_gpipe: GPipe pipeline parallelism for TensorFlow 2 and Lingvo.

Installs the library only; params/, tools/ and tests/ are repository files.
"""

import setuptools

setuptools.setup(
    name='lingvo_gpipe',
    version='0.1.0',
    description='GPipe pipeline parallelism for TensorFlow 2 and Lingvo.',
    long_description=open('README.md').read(),
    long_description_content_type='text/markdown',
    packages=setuptools.find_packages(include=['lingvo_gpipe',
                                               'lingvo_gpipe.*']),
    python_requires='==3.11.*',
    install_requires=[
        'tensorflow==2.21.*',
        'lingvo==0.14.2',
        'numpy',
        'absl-py',
    ],
)
